"""Training an EAGLE-3 draft: chat data (data/, data_cli.py), the target's own answers (regenerate.py,
synthesize.py), the draft vocabulary (vocab.py), hidden-state dumps (hidden_dump.py, dump_reader.py), the
training-time-test loss (ttt.py) and the training loop (trainer/)."""
