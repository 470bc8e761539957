"""The thin HTTP front: validates, tokenizes, enqueues through ``shared``'s queue client and relays tokens.

It loads a tokenizer per served model (chat templates, token limits), never a model."""
