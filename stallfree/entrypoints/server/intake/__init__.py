"""From a request body to engine inputs: the checks before a body is used (screening, also in
a separate process, so this package stays light), its cost, its structured-output spellings,
and the prompt ids and `SamplingParams` it becomes."""
