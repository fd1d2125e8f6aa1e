"""Beside the HTTP routes (app/ingress.py): errors in OpenAI's shape, stream helpers, keys and admission."""
