"""The serving engine, the OpenAI-compatible server and its benchmark's figures."""
