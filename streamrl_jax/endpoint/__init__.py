"""An OpenAI-compatible endpoint over the generation service (docs/endpoint.md).

Agent scaffolds talk to the policy through `/v1/chat/completions` and
`/v1/completions`; every request belongs to an episode the endpoint issued, and the
endpoint keeps what the policy sampled (token ids, behaviour log-probs, versions) so
the episode is trained on exactly those tokens. Modules: `api.py` (request bodies,
limits, errors), `book.py` (episode ids and records), `turns.py` (a request as the
episode's next turn; template boundaries), `backend.py` (the generation service behind
futures), `server.py` (FastAPI on uvicorn; the trust boundary), `client.py` (the
scaffold's helper).
"""
