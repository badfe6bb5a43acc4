package replyspin

import "time"

// Average returns the running average reply time (zero before the first).
func (s *Spinner) Average() time.Duration { return time.Duration(s.avg.Load()) }

// Marked reports whether a call is marked now.
func (s *Spinner) Marked() bool { return s.cur.Load() != 0 }
