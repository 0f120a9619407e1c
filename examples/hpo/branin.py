"""A fast synthetic trial: the Branin function, reported as a short learning curve.

Usage: ``python branin.py X1 X2 [--steps N] [--sleep S]``. Prints ``step=i loss=…`` lines
in Katib's format whose values decay towards ``branin(x1, x2)``, so early stopping has a
curve to judge; the last line is the function value itself. Its global minimum is
0.397887 at (-pi, 12.275), (pi, 2.275) and (9.42478, 2.475).
"""

from __future__ import annotations

import argparse
import math
import time


def branin(x1: float, x2: float) -> float:
    """Branin-Hoo on ``x1 in [-5, 10], x2 in [0, 15]``."""
    b, c = 5.1 / (4 * math.pi**2), 5 / math.pi
    t = 1 / (8 * math.pi)
    return (x2 - b * x1**2 + c * x1 - 6) ** 2 + 10 * (1 - t) * math.cos(x1) + 10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("x1", type=float)
    parser.add_argument("x2", type=float)
    parser.add_argument("--steps", type=int, default=1, help="learning-curve length")
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds per step")
    args = parser.parse_args()
    value = branin(args.x1, args.x2)
    for step in range(1, args.steps + 1):
        # Decays from 2x+1 towards the true value: a curve whose ranking is the final one.
        print(f"epoch {step}/{args.steps}: step={step} loss={value * (1 + 1 / step):.6e}")
        time.sleep(args.sleep)
    print(f"final loss={value:.6e}")


if __name__ == "__main__":
    main()
