"""Ray actors, Serve ingress, config, metrics export, CLI and the offline LLM class."""
