"""Text: tokenizers, request validation, and output processing (detokenisation, stop strings, chunks)."""
