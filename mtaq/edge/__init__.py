"""Inbound SMTP (aiosmtpd): validate, append, wait for the covering fsync, then reply."""
