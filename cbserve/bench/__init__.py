"""The load generator behind ``cbserve bench`` (no Ray): ``cli`` (the subcommand), ``runner`` (one run on an
arrival schedule), ``client`` (streaming OpenAI-API client), ``datasets``, ``metrics`` (arrival schedules,
summary statistics), ``report`` and ``plots``, ``cpu_profile`` (CPU seconds per process of a server's tree,
py-spy); ``deploy`` starts a throw-away deployment (or any server) in a child process for benchmarks and tests
(only that child imports Ray)."""
