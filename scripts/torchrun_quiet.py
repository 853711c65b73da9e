"""Run torchrun with its own failure report filtered out of stderr (scripts/common.sh).

torchrun follows every clean one-line error of pretrain_gpt.py with its own log lines and
a ChildFailedError traceback (~55 lines), and a Ctrl-C with a SignalException traceback;
the project's line is then buried. This passes the workers' output through unchanged and
drops only torchrun's: its logger lines (``E1201 20:19:45.43 123 .../torch/distributed/
elastic/...``), its start-up banner (a blank line, then the OMP_NUM_THREADS notice between
two rules of asterisks: the project sets its own threads), and a traceback whose first
frame is the launcher's (``File "<frozen runpy>"``) up to the end of its failure table. A
worker's own traceback (a bug) is kept.

Exit status: torchrun's, except after Ctrl-C (SIGINT), where the workers finish their
step, save and stop: 130 (128 + SIGINT, the shell's convention), or 1 if a worker
reported an error.

    python scripts/torchrun_quiet.py TORCHRUN_ARGS...
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys

_LOGGER = re.compile(r"^[EWIDF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ .*torch/distributed/")
_BANNER = re.compile(r"^\*{20,}$")
_NOTICE = re.compile(r"^Setting OMP_NUM_THREADS environment variable for each process")
_ERROR = re.compile(r"^\S+: error: ")


class Filter:
    """Line by line: True for the lines to show."""

    def __init__(self):
        self.held: str | None = None  # a "Traceback" line, until its first frame is seen
        self.in_report = False  # inside torchrun's traceback and failure table
        self.rules = 0  # "=====" lines seen in the failure table (it ends with the 3rd)
        self.errors = 0
        self.started = False  # a line has been shown (a blank line before that is the banner's)

    def feed(self, line: str) -> list[str]:
        text = line.rstrip("\n")
        if self.in_report:
            self.rules += text.startswith("=" * 20)
            self.in_report = self.rules < 3
            return []
        if self.held is not None:
            held, self.held = self.held, None
            if text.lstrip().startswith('File "<frozen runpy>"'):
                self.in_report, self.rules = True, 0
                return []
            return [held, *self.feed(line)]
        if text == "Traceback (most recent call last):":
            self.held = line
            return []
        if _LOGGER.match(text) or _BANNER.match(text) or _NOTICE.match(text):
            return []
        if not text and not self.started:
            return []
        self.started = True
        self.errors += bool(_ERROR.match(text))
        return [line]

    def flush(self) -> list[str]:
        held, self.held = self.held, None
        return [held] if held is not None else []


def main(argv: list[str]) -> int:
    interrupted = []
    # The terminal sends SIGINT to torchrun and its workers as well: here it only decides
    # the exit status; the workers stop themselves (and save).
    signal.signal(signal.SIGINT, lambda *_: interrupted.append(True))
    job = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", *argv],
        stderr=subprocess.PIPE,
        text=True,
        bufsize=1,
    )
    keep = Filter()
    for line in job.stderr:
        for out in keep.feed(line):
            sys.stderr.write(out)
            sys.stderr.flush()
    for out in keep.flush():
        sys.stderr.write(out)
    code = job.wait()
    if interrupted:
        return 1 if keep.errors else 130
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
