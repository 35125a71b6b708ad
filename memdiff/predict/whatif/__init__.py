"""`memdiff whatif`: one recorded run replayed with each change (engine.py runs the rules, one
module a rule); buyback.py picks the changes that bring a regressed run's peak back."""

from memdiff.predict.whatif.buyback import BuyBack, BuyBackPart, BuyBackTarget, buy_back
from memdiff.predict.whatif.engine import Change, ChangePrediction, DeviceWhatIf, WhatIf, parse_change, whatif

__all__ = ["BuyBack", "BuyBackPart", "BuyBackTarget", "Change", "ChangePrediction", "DeviceWhatIf", "WhatIf",
           "buy_back", "parse_change", "whatif"]
