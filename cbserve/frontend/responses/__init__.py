"""The Responses API over the chat flow: its protocol, its request flow, its output items and events, its store."""
