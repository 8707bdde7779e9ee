"""Step 2 and 3, layout and check: chat-template frames, token-exact layouts built in the Rust core,
the GGUF tokenizer import, and the pre-send gate every command runs before a request."""
