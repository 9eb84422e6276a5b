"""Not code: the systemd unit files, shipped in the wheel as package data of
``edgeq.deploy.units`` (pyproject.toml) so ``edgeq bundle`` finds them without a checkout."""
