"""The load generator behind ``cbserve bench`` (no Ray): ``cli`` (the subcommand), ``runner`` (one run on an
arrival schedule), ``client`` (streaming OpenAI-API client), ``datasets``, ``metrics`` (arrival schedules,
summary statistics), ``report`` and ``plots``; ``deploy`` starts a throw-away deployment in a child process
for benchmarks and tests (only that child imports Ray)."""
