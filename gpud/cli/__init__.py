"""`gpudctl`: talk to a running gpud (`inspect`) and plan placements, offline or live (`place`). One module per
command, the HTTP client they share in `client`, the dispatcher in `main`."""
