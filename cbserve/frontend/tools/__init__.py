"""Tool calling, structured output and reasoning at the edge."""
