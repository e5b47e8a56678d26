"""Low-rank storage: the storage (``storage``), one layer's store (``store``), bases from calibration moments
(``bases``), field checks (``config``) and the calibration pass that measures the moments
(``calibration*``)."""
