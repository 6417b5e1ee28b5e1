"""What leaves the server for a request: merged engine streams and Server-Sent Events, the
response bodies, logprobs in the OpenAI shapes, and OpenTelemetry spans."""
