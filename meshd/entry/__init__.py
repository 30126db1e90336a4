"""meshd.entry: one generation at an entry daemon: its state, the route it takes, the attempts over
that route, and the policies (retry, busy, fallback, handing a request to another entry) as pure code."""
