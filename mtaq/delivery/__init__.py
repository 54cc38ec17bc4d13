"""Outbound SMTP (aiosmtplib): per-recipient final replies from the next hop."""
