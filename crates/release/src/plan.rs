//! (being built: plan, router, judge, controller)
