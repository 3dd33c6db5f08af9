from tokenworks.tokenizer.chat import ChatTemplateError
from tokenworks.tokenizer.detokenize import DecodeStream
from tokenworks.tokenizer.tokenizer import TokenizerError, TokenizerWrapper

__all__ = ["ChatTemplateError", "DecodeStream", "TokenizerError", "TokenizerWrapper"]
