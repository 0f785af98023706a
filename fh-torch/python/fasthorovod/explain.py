"""``python -m fasthorovod.explain DIR``: what the ranks' flight records in DIR show.

Every rank keeps its last few thousand operations in memory and writes them to a file of its
own (``rank-R.json``) in the flight directory on a stall warning, when its runtime stops on
an error, or on ``SIGUSR1``. This names the first divergence across the ranks — the rank that
never submitted a tensor the others wait on, the rank that sent a different shape, a lost
rank — and the last collective every rank completed. An elastic job's flight directory holds
a subdirectory per generation (``gen-N``): each generation is explained under a line naming
it. ``fhrun --explain DIR`` prints the same.
"""

import sys

from fasthorovod import _core


def explain(directory):
    """The report on the flight records in ``directory``, as text (``ValueError`` when the
    directory holds none, or a file is not a flight record)."""
    return _core.explain(str(directory))


def main(argv=None):
    """Print the report for the directory named on the command line; the exit status."""
    args = sys.argv[1:] if argv is None else list(argv)
    if len(args) != 1 or args[0] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stderr)
        print("\nusage: python -m fasthorovod.explain DIR", file=sys.stderr)
        return 2
    try:
        sys.stdout.write(explain(args[0]))
    except ValueError as e:
        print(f"fasthorovod.explain: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
