"""The HTTP client of the generation server: requests, answers, errors and the server pool."""
