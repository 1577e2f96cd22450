"""Config, Ray Serve application, OpenAI-compatible ingress and CLI."""
