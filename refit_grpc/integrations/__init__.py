"""Adapters that put refit_grpc behind other frameworks' interfaces.

Each lives in its own module and imports its framework there, so none is a dependency of
`refit_grpc` itself: `refit_grpc.integrations.ray` needs the `ray` extra
(`pip install 'refit_grpc[ray]'`). This package imports none of them.
"""
