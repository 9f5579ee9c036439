"""Models behind one small interface (see models.base.Model)."""
