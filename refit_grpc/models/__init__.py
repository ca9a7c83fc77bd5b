"""Small models the reference engine serves and the demo trains."""
