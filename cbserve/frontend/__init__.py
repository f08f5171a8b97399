"""The front end: tokenizer and chat template, request validation, OpenAI protocol models, incremental
detokenization and stop strings, and the offline ``LLM`` — one output processor for both."""
