"""Serving: a continuous-batching engine over the speculative round (`engine`), the 2-D deficit round-robin
scheduler over verify tokens and expert bytes (`scheduler`), and an OpenAI-compatible server (`server`,
`dflash-serve`; needs the `serve` extra). Importing this package imports neither FastAPI nor the engine."""
