"""Chaos: at np 4, over shm and tcp, started from the environment and under ``fhrun -np 4``,
one rank is SIGKILLed, SIGSTOPped or raises at a random moment (start-up, negotiation, an
inline group, a fused group, a partitioned tensor, shutdown); every survivor must end with an
error naming that rank within FH_TIMEOUT_SECONDS + 2 s of the fault, and nothing may hang or
be left running. The runs are drawn from a seed (printed; ``FH_CHAOS_SEED``,
``FH_CHAOS_ONLY`` replay them); ``FH_CHAOS_RUNS`` sets how many (60 by default, about 5 min
on 2 cores; e.g. 500 for a soak). ``FH_CHAOS_REPORT=path.json`` writes the summary."""

import chaos_harness as ch


def test_no_rank_waits_forever(capsys):
    cfg = ch.Config.from_env()
    with capsys.disabled():
        print()
        summary = ch.run_suite(cfg, log=lambda m: print(m, flush=True))
        print(ch.format_summary(summary, details=False), flush=True)
    assert summary["failed_runs"] == 0, ch.format_summary(summary)
