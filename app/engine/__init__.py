"""The project's own decoding engine, for the rollout actors and the server alike: continuous batching over a
transformers model, every running sequence in a slot of one KV cache, every step one forward over all the tokens
that step computes (each running sequence's next token and the prompt chunks of those just admitted), rows joining
and leaving at any step, each with its own sampling settings, seed and adapter.

cache.py (the slots' keys and values), attention.py (the attention function the model runs through), layout.py
(what one step computes, token by token), sampling.py (each row's next token and log-probabilities),
sequence.py (one request's row), text.py (its text as it streams, and the stop sequences), routing.py (the forward
a step's adapters take), core.py (the scheduler and the step), engine.py (the core in a thread of its own, with
work done between steps).
"""
