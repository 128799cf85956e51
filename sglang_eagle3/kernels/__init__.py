"""The one boundary to the C++ extension (csrc/): extension.py builds and loads it, decode.py and training.py wrap
every op with its plain-PyTorch twin. Nothing else in the package calls the extension."""
