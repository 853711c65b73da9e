"""Dynamic loss scaling for fp16: back off on overflow, grow after a clean window."""

from __future__ import annotations


class DynamicLossScaler:
    def __init__(
        self,
        initial: float = 2.0**16,
        min: float = 1.0,
        window: int = 1000,
        hysteresis: int = 2,
        factor: float = 2.0,
    ):
        self.scale, self.min_scale, self.window = float(initial), float(min), window
        self.hysteresis, self.factor = hysteresis, factor
        self._hysteresis_left, self._clean_steps = hysteresis, 0
        self.overflows = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.overflows += 1
            self._clean_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.scale / self.factor, self.min_scale)
        else:
            self._clean_steps += 1
            if self._clean_steps >= self.window:
                self.scale *= self.factor
                self._clean_steps = 0
                self._hysteresis_left = self.hysteresis

    def state_dict(self) -> dict:
        return dict(
            scale=self.scale,
            hysteresis_left=self._hysteresis_left,
            clean_steps=self._clean_steps,
            overflows=self.overflows,
        )

    def load_state_dict(self, state: dict) -> None:
        self.scale = state["scale"]
        self._hysteresis_left = state["hysteresis_left"]
        self._clean_steps = state["clean_steps"]
        self.overflows = state["overflows"]


class ConstantLossScaler:
    """fp32/bf16: no scaling, never an overflow to react to."""

    scale = 1.0
    overflows = 0

    def update(self, overflow: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass
