"""The HTTP layer: routes (ingress), OpenAI requests and responses (openai_requests, openai_responses), errors in
OpenAI's shape, stream helpers, API keys and admission, and the extension points the agents fill."""
