"""The HTTP layer: routes (ingress), OpenAI request and response shapes (openai_api), errors in
OpenAI's shape, stream helpers, API keys and admission, and the extension points the agents fill."""
