"""The S3 backend against moto's server over HTTP (the session's ``moto_endpoint``, tests/conftest.py)."""
