"""Training data: read chat sources, render with the target's chat template, mask assistant tokens, write to disk."""
from sglang_eagle3.training.data.build import (  # noqa: F401
                                               DATA_FILE,
                                               STATS_FILE,
                                               iter_tokenized,
                                               load_tokenized,
                                               prepare_dataset,
                                               read_stats,
)
from sglang_eagle3.training.data.chat import ChatRenderer, ChatTemplateError, Encoded  # noqa: F401
from sglang_eagle3.training.data.formats import (  # noqa: F401
                                               FORMATS,
                                               BadRow,
                                               Conversation,
                                               DataError,
                                               Source,
                                               detect_format,
                                               normalise,
                                               parse_source,
                                               parse_sources,
                                               read_source,
)
