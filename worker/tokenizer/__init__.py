"""Text: the tokenizer, exact incremental tokenization of text chunks, detokenization."""
