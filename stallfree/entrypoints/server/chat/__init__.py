"""A chat reply read and constrained: the request's tools for the template and the grammar of a
forced call, tool calls and reasoning split out of the model's text as it grows."""
