"""A request in the engine: its parameters, its sequences, its adapter, the length rule and what admission refuses."""
