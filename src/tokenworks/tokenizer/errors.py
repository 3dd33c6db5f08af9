class TokenizerError(ValueError):
    """A model's tokenizer cannot be built or used as asked; the message says what to do."""
