"""Canaries of every kind of PII and secret the issue #22 attack planted (and the older kinds):
each must be found in no byte servelens writes once sent in any string field or as a field name."""

from __future__ import annotations

#: kind -> a value of that kind (distinct substrings, so a hit names its kind).
CANARIES = {
    "PERSON": "Maria Garcia",
    "STREET_ADDRESS": "1742 Evergreen Terrace",
    "US_SSN": "078051120",
    "US_SSN_DASHES": "219-09-9999",
    "AWS_SECRET": "aws_secret_access_key=wJalrXUtnFEMIK7MDENGbPxRfiCYzEXAMPLEKEY",
    "STRIPE_KEY": "sk_live_4eC39HqLyjWDarjtT1zdp7dc",
    "SLACK_TOKEN": "xoxb-263594206564-2343524856743-bd1qDgFlv9CMcBl3bl0tF9dn",
    "GOOGLE_API_KEY": "AIzaSyA1b2C3d4E5f6G7h8I9j0KlMnOpQrStUvW",
    "PRIVATE_KEY": "-----BEGIN RSA PRIVATE KEY-----",
    "EMAIL_ADDRESS": "margaret.t@example.org",
    "PHONE_NUMBER": "+1 (415) 555-0199",
}

#: The fragment of each canary whose presence in a written byte means it leaked (the distinctive part).
FRAGMENTS = {
    "PERSON": "Garcia",
    "STREET_ADDRESS": "Evergreen",
    "US_SSN": "078051120",
    "US_SSN_DASHES": "219-09-9999",
    "AWS_SECRET": "wJalrXUtnFEMIK7MDENG",
    "STRIPE_KEY": "4eC39HqLyjWDarjtT1zdp7dc",
    "SLACK_TOKEN": "263594206564",
    "GOOGLE_API_KEY": "A1b2C3d4E5f6G7h8",
    "PRIVATE_KEY": "PRIVATE KEY",
    "EMAIL_ADDRESS": "margaret.t",
    "PHONE_NUMBER": "555-0199",
}

#: Field names carrying secrets (a producer may send a secret as a name).
SECRET_FIELD_NAMES = ["aws_secret_access_key_wJalrXUtnFEMIK7MDENG", "sk_live_4eC39HqLyjWDarjtT1zdp7dc",
                      "Maria Garcia"]


def leaks(data: bytes) -> list[str]:
    """The kinds whose fragment occurs in ``data`` (as UTF-8)."""
    return [kind for kind, fragment in FRAGMENTS.items() if fragment.encode() in data]
