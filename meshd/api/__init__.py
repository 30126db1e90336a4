"""Front doors: the OpenAI-compatible HTTP API (`http`) and its request and answer shapes (`openai`)."""
