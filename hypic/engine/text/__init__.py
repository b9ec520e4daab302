"""Text handling: tokenization, chat templates, incremental detokenization, stop strings."""
