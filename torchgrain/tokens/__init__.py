"""Token windows for language-model training: packed windows over tokenized documents
(``Dataset.windows``), padding collates, and tokenizer hooks."""
