"""The random-kill elastic stage: elastic jobs of ``fhrun --host-discovery-script`` on loopback
"hosts", training a perceptron of 26 buckets, with a worker SIGKILLed at a random moment
(during backward, a training step, a commit, a re-forming of the world, a new worker's
arrival); every run must finish with every last worker's parameters equal to the replay of
the committed worlds (or, when the plan leaves fewer than --min-np workers, fail naming that
cause), in bounded time, without a world formed after the job finished. The runs are drawn
from a seed (printed; ``FH_EKILL_SEED``, ``FH_EKILL_ONLY`` replay them); ``FH_EKILL_RUNS``
sets how many (50 by default; more for the long mode). ``FH_EKILL_REPORT=path.json`` writes
the summary. See README.md."""

import ekill_harness as eh


def test_every_run_finishes_equal_to_its_replay_or_names_why_not(capsys):
    cfg = eh.Config.from_env()
    with capsys.disabled():
        print()
        summary = eh.run_suite(cfg, log=lambda m: print(m, flush=True))
        print(eh.format_summary(summary, details=False), flush=True)
    assert summary["failed_runs"] == 0, eh.format_summary(summary)
