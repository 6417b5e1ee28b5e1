"""What every room of the server shares: the request and error models, `ApiError`, the app's
state and the model's own sampling defaults."""
