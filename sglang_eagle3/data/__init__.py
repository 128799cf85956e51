"""Training data: read chat sources, render with the target's chat template, mask assistant tokens, write to disk."""
from .build import (DATA_FILE, STATS_FILE, iter_tokenized, load_tokenized, prepare_dataset,  # noqa: F401
                    read_stats)
from .chat import ChatRenderer, ChatTemplateError, Encoded  # noqa: F401
from .formats import (FORMATS, BadRow, Conversation, DataError, Source, detect_format,  # noqa: F401
                      normalise, parse_source, parse_sources, read_source)
