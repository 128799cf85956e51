"""The speculative decoding engine: what a run decodes with (settings.py, speculation.py, and profile.py: the tuned
spec_profile.json), the draft tree (tree.py), lossless verification (verify.py), the speculative worker
(spec_worker.py: propose -> plan -> verify -> commit) and its proposers (proposers.py: the draft model; suffix.py: the
context), the scheduler (scheduler.py: queue, rows, stops, detokenization), the offline client (engine.py) and
`eagle3 generate` (cli.py)."""
