"""What every HTTP request and connection passes before the app sees it: the `Guard`
middleware (request ids, body limit, concurrency limit, drain refusals) and uvicorn's HTTP/1.1
protocol with a connection budget and deadlines."""
