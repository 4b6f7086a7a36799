"""Wire types of kvtier: declared once here, decoded straight into typed structs.

Nothing outside this package defines a message layout. See README.md beside this file.
"""
